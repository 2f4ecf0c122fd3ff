"""Placeholder until its issue lands."""
if __name__ == "__main__":
    print("not implemented yet")
