"""A store several gateways share: each batch's lease (which runner runs it, until when), the order rows were made in
(SQLite's rowid served; PostgreSQL has none), and the files' bytes as rows (a PostgreSQL store keeps them there).

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0002", "0001"


def upgrade() -> None:
    for table in ("files", "batches"):
        op.add_column(table, sa.Column("made_ns", sa.BigInteger))
        if op.get_bind().dialect.name == "sqlite":  # rows made before: in rowid's order, before any new one
            op.execute(f"UPDATE {table} SET made_ns = rowid")
    op.add_column("batches", sa.Column("runner", sa.Text))
    op.add_column("batches", sa.Column("lease_until", sa.Float))
    op.create_index("files_by_owner", "files", ["owner", "made_ns"])
    op.create_index("batches_by_owner", "batches", ["owner", "made_ns"])
    op.create_table("file_chunks", sa.Column("file_id", sa.Text, primary_key=True),
                    sa.Column("n", sa.Integer, primary_key=True), sa.Column("data", sa.LargeBinary, nullable=False))
