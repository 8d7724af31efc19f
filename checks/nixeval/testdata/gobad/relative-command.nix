# want: Relative command
{ services.nixcage = { enable = true; agents.a = { backend = "service"; command = [ "claude" ]; }; }; }
