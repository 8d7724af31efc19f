# want: No argument or block type is named "autostrat". Did you mean "autostart"?
{ services.nixcage = { enable = true; agents.a = { backend = "service"; command = [ "/bin/true" ]; }; settings.agent.a.autostrat = false; }; }
