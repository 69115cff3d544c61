"""The bottom layer: safe reads of untrusted run directories (`safeio`), atomic JSON and
text writes (`atomic`) and secret redaction (`redact`).

May import: the standard library only.
"""
