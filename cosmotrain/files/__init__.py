"""What every command shares about the disk.

``atomic`` (files that appear whole or not at all, and one-line errors when the disk says
no), ``run_lock`` (one writer per output directory), ``previous`` (the
``previous-<time>`` names of what is moved aside, never deleted, and the one refusal of an
existing output).  Imports nothing of cosmotrain but ``errors``.
"""
