"""``make upstream``: each finding's standalone repro on the stock release and with its fix.diff."""
