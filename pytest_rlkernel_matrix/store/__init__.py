"""The bottom layer: the one door for files under a matrix root (`safeio`: reads of regular
files only, bounded, no link leaving the root; writes, appends and locks opened without
following links and checked; strict JSON), atomic JSON and text writes (`atomic`) and secret
redaction (`redact`).

May import: the standard library only.
"""
