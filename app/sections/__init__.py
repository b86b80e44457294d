"""Parts of a page that are not pages themselves (each drawn by the page that imports it)."""
