"""What a secret does: sealed records and MACs on frames (sealing.py), and signed values in the
store (signed.py)."""
