"""The data package's user-facing error (one line naming the source, the problem and the fix)."""

from disagmoe_ds.errors import DisagMoEError


class DataError(DisagMoEError):
    """A data source, tokenizer or packing setting cannot produce training samples."""
