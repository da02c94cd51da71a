"""Alembic environment: runs on the connection hetsched.store.db hands over."""

from alembic import context
from sqlalchemy import create_engine

from hetsched.errors import InputError
from hetsched.store.tables import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise InputError("expected the database URL to migrate (alembic -x or alembic.ini)", field="sqlalchemy.url")
    connection = create_engine(url).connect()
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
