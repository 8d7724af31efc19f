# want: services.nixcage.agents."a".egress = "nope" names no policy. Declare services.nixcage.egressPolicies."nope"
{ services.nixcage.agents.a = { backend = "service"; command = [ "/bin/true" ]; egress = "nope"; }; }
