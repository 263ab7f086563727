"""A stream of self-describing buckets through two slots per receiver: for trainers whose
receivers learn names, shapes and dtypes only as the tensors arrive (verl's checkpoint engine,
transport/integrations/verl/, runs on it). Each bucket carries its own header; every trainer rank
sees the whole stream and the ranks split the buckets without talking; receivers relay in a tree
above a few of them. Framework-free: it needs only this library."""
