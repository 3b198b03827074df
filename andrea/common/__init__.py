"""What every layer uses: the one error type, atomic writes, content hashes, range-checked options."""
