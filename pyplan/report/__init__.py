"""Reports: the data of each report as plain dicts, and its rendering as rich tables."""
