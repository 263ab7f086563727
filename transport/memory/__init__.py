"""This process's memory as the peers see it: registrations and the tensor checks (local.py), the
regions it exposes and its record's memory map (regions.py), and the map's wire codec
(region_codec.py)."""
