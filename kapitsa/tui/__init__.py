"""kapitsa.tui"""
