"""Where tables and source files live: local folders or S3 (`s3`), and the
allow-list of storage roots a spec's locations must stay inside (`roots`)."""
