# want: services.nixcage.store.threshold = 2 but store.keys lists 1 key(s)
{ services.nixcage.store = { channel = "stable"; keys = [ "/etc/nixcage/release.pub" ]; threshold = 2; }; }
