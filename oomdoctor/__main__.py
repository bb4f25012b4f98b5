"""``python -m oomdoctor`` == the ``oomdoctor`` command."""

from oomdoctor.cli import main

main()
