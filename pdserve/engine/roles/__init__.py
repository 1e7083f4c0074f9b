"""What differs between a collocated, a prefill and a decode engine (see base.py)."""
