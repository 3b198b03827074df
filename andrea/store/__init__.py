"""What runs read and write on disk: checkpoints, run files, shards and their loader and mixing, manifests, identity."""
