"""Code that runs inside an engine process: cheap, never raises into the engine, bounded."""
