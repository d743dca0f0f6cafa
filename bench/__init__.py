"""dalid's benchmark suite: ``python -m bench`` compares dalid with DALI and a torch loader.

See bench/README.md for the contenders and the metrics, bench/results/ for the results.
"""
