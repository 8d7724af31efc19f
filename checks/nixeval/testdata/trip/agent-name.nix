# want: services.nixcage.agents."Bad_Name": agent names
{ services.nixcage.agents.Bad_Name = { backend = "service"; command = [ "/bin/true" ]; }; }
