"""Training data as users have it, read and checked without torch or a tokenizer: files.py reads a path (jsonl,
JSON array, parquet, Arrow, or a folder of them) into rows that know their file and line; formats.py turns each
row into a Sample of one format (text, chat, alpaca, ShareGPT, prompt/completion). runtime/train/data.py
tokenizes Samples with the release's tokenizer and packs them into rows."""
