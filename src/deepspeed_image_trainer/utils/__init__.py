"""The lowest layer: user errors and their exit statuses, files published whole, checked loading of torch files,
message text."""
