"""What the pages show, one module per page's subject: built once for the page, its JSON API and its live push alike."""
