"""kapitsa.agents"""
