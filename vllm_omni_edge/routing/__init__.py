"""Which cpu_int4 path runs on which CPU, from measured tables (weight_path.py)."""
