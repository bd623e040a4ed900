"""python -m jaxgin.settings: prints the settings table docs/guide.md shows, to paste there."""

from jaxgin.settings import markdown_table

print(markdown_table(), end="")
