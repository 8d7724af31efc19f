# want: Reserved environment variable
{ services.nixcage = { enable = true; agents.a = { backend = "service"; command = [ "/bin/true" ]; environment.HTTP_PROXY = "http://elsewhere:3128"; }; }; }
