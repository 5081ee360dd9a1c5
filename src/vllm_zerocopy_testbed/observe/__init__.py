"""What every vLLM process of the testbed says about itself: its log lines (``log``: the mode
line, ranks, wire sends) and its C heap (``heap``: the probe files ``make soak`` reads).

The vLLM-side packages all use it (``plugins`` load it, ``patches`` log through it, ``node``
reads the probe files), so it imports none of them.
"""
