"""The ground floor: the records, errors, wire formats and contracts that every floor above may import. It imports nothing of groupflow but itself and the config."""
