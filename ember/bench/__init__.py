"""`ember bench ...`: benchmark clients that ship with Ember (`ember bench serve`)."""
