"""alembic's environment: the connection `upgrade` passes (no alembic.ini, no URL here)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, transaction_per_migration=False)
with context.begin_transaction():
    context.run_migrations()
