"""Small leaf utilities shared by the project's packages; imports nothing of the project.

Kept to what more than one package needs, so that the router, the engine and the cache daemon can use
one copy without importing each other.
"""
