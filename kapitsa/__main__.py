from kapitsa.cli import main

main()
