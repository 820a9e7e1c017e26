"""The command line, `python -m kvplay COMMAND`: main.py parses and dispatches, common.py holds the
progress bar and the table printer every command shares."""
