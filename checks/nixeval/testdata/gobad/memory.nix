# want: Invalid memory limit
{ services.nixcage = { enable = true; agents.a = { backend = "service"; command = [ "/bin/true" ]; resources.memory = "2 GB"; }; }; }
