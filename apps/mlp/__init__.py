"""A small click model on libFM data: the platform's smoke-test and demo job for the data-parallel framework."""
