"""Data readers the apps share (libFM text, line blocks)."""
