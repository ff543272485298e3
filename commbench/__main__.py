from commbench.cli import entry

entry()
