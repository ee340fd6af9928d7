"""The processes nbshard starts: launchers, ranks, the warm process, and their supervision."""
