"""Other libraries' models on multihead's kernel. Each integration imports its library; nothing else here does."""
