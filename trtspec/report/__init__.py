"""What a reviewer reads and signs: the report (markdown, HTML, plots), MLflow tracking and the
approval record."""
