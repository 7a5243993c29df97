"""Storage, launching, recipes and tracking shared by every stage."""
