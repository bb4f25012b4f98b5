"""`oomdoctor explain` (being written)."""
