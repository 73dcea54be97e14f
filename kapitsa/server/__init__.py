"""kapitsa.server"""
