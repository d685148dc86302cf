"""Performance harness: ratios against a baseline measured in the same run, saved as JSON with the device.

Timed code is never part of pass/fail; see book/reproducing.md for how to read the numbers.
"""
