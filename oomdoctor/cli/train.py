"""`oomdoctor train` (being written)."""
