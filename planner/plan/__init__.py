"""The plan file: its schema, the writer and strict reader, the rules across its fields, older schemas, and
make's bounds that the reader holds plans to."""
