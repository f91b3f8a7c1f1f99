from connector.cli import main

raise SystemExit(main())
