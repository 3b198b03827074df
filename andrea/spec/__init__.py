"""What an experiment specifies: its format and checks, the precisions, the parameter layout, the memory plan."""
