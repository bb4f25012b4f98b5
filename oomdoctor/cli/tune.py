"""`oomdoctor tune` (being written)."""
