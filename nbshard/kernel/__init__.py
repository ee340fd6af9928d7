"""The kernel's side: what runs inside the notebook's kernel. Never imports torch."""
